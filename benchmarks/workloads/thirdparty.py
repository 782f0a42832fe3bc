"""Third-party architectures at tiny sizes, for the sweep (`benchmarks/workloads/sweep.py`,
`tests/models/test_sweep.py`, `benchmarks/models.py`): HF transformers, torchvision and timm models built from
configs (never from downloaded weights), each with example inputs and its own training loss.

Sizes: 2 layers, hidden 32, 4 heads, vocabulary 128, sequences of 8 tokens, batch 4 (divisible by the
sweep's batch axis), images of 32 px (16 px for the transformer vision models). Dropout is left at each
library's default, so the sweep exercises it. `build(name)` returns `(model, inputs, loss_fn)` with real
CPU weights from a fixed seed; `NAMES` lists them in sweep order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Workload = tuple[nn.Module, tuple[torch.Tensor, ...], Callable[..., torch.Tensor]]

B, S, V, H = 4, 8, 128, 32


def _ids(*shape: int) -> torch.Tensor:
    return torch.randint(3, V, shape)


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _mlm_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, labels=ids).loss


def _seq2seq_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=labels).loss


def _image_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(pixel_values=x, labels=y).loss


def _ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _seg_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x)["out"], y)


def _clip_loss(model: nn.Module, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, pixel_values=x, return_loss=True).loss


def _decoder(cls: str, cfg: str, **kw) -> Callable[[], Workload]:
    def make() -> Workload:
        import transformers

        base = dict(num_hidden_layers=2, hidden_size=H, intermediate_size=2 * H, num_attention_heads=4,
                    vocab_size=V, max_position_embeddings=64)
        config = getattr(transformers, cfg)(**{**base, **kw})
        return getattr(transformers, cls)(config), (_ids(B, S),), _lm_loss

    return make


def _hf(cls: str, cfg: str, inputs: Callable[[], tuple[torch.Tensor, ...]], loss, **kw) -> Callable[[], Workload]:
    def make() -> Workload:
        import transformers

        return getattr(transformers, cls)(getattr(transformers, cfg)(**kw)), inputs(), loss

    return make


def _mlm_inputs() -> tuple[torch.Tensor, ...]:
    ids = _ids(B, S)
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0  # padded tails: the attention mask is not all ones
    return ids, mask


def _image_inputs(px: int = 16, classes: int = 4) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: (torch.randn(B, 3, px, px), torch.randint(0, classes, (B,)))


_ENC = dict(num_hidden_layers=2, hidden_size=H, intermediate_size=2 * H, num_attention_heads=4, vocab_size=V,
            max_position_embeddings=64)
_VIS = dict(image_size=16, patch_size=4, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=2 * H, num_labels=4)


def _tv(fn: Callable[[], nn.Module], px: int = 32) -> Callable[[], Workload]:
    def make() -> Workload:
        return fn(), (torch.randn(B, 3, px, px), torch.randint(0, 10, (B,))), _ce

    return make


def _timm(name: str, px: int = 32, **kw) -> Callable[[], Workload]:
    def make() -> Workload:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10, **kw), (
            torch.randn(B, 3, px, px), torch.randint(0, 10, (B,))), _ce

    return make


def _timm_class(path: str, px: int = 32, **kw) -> Callable[[], Workload]:
    """A timm architecture class built directly, where no registered variant is small."""

    def make() -> Workload:
        import importlib

        mod, cls = path.rsplit(".", 1)
        model = getattr(importlib.import_module(f"timm.models.{mod}"), cls)(num_classes=10, **kw)
        return model, (torch.randn(B, 3, px, px), torch.randint(0, 10, (B,))), _ce

    return make


def _tvm():
    import torchvision

    return torchvision.models


def _segmentation() -> Workload:
    m = _tvm().segmentation.lraspp_mobilenet_v3_large(num_classes=4, weights=None, weights_backbone=None)
    return m, (torch.randn(B, 3, 32, 32), torch.randint(0, 4, (B, 32, 32))), _seg_loss


class _EncoderLM(nn.Module):
    """A stock `nn.TransformerEncoder` language model: `nn.MultiheadAttention`'s packed q/k/v projection under a
    causal mask and a key padding mask (pre-norm layers, torch's default dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        layer = nn.TransformerEncoderLayer(H, 4, 2 * H, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(H, V)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=self.head.weight.dtype)
        return self.head(self.encoder(self.embed(ids), mask=causal, src_key_padding_mask=pad, is_causal=True))


def _encoder_lm() -> Workload:
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1::2, -2:] = True  # (padded keys at the end: every query still sees its first key)
    return _EncoderLM(), (_ids(B, S), pad), _encoder_lm_loss


def _encoder_lm_loss(model: nn.Module, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids, pad)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _whisper() -> Workload:
    import transformers

    cfg = transformers.WhisperConfig(d_model=H, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=2 * H, decoder_ffn_dim=2 * H,
                                     num_mel_bins=8, max_source_positions=8, max_target_positions=16,
                                     vocab_size=V, pad_token_id=0, decoder_start_token_id=1)
    model = transformers.WhisperForConditionalGeneration(cfg)
    return model, (torch.randn(B, 8, 16), _ids(B, S)), lambda m, x, y: m(input_features=x, labels=y).loss


def _clip() -> Workload:
    import transformers

    cfg = transformers.CLIPConfig(
        text_config=dict(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=V, max_position_embeddings=16),
        vision_config=dict(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=4), projection_dim=16)
    return transformers.CLIPModel(cfg), (_ids(B, S), torch.randn(B, 3, 16, 16)), _clip_loss


def _wav2vec2() -> Workload:
    import transformers

    cfg = transformers.Wav2Vec2Config(hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=2 * H, conv_dim=(16, 16), conv_stride=(4, 2),
                                      conv_kernel=(8, 4), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
                                      num_labels=4, mask_time_prob=0.0)
    model = transformers.Wav2Vec2ForSequenceClassification(cfg)
    return model, (torch.randn(B, 400), torch.randint(0, 4, (B,))), lambda m, x, y: m(input_values=x, labels=y).loss


def _resnet_bottleneck() -> nn.Module:
    tv = _tvm()
    return tv.resnet.ResNet(tv.resnet.Bottleneck, [1, 1, 1, 1], num_classes=10)


def _convnext() -> nn.Module:
    tv = _tvm()
    cn = tv.convnext
    return cn.ConvNeXt([cn.CNBlockConfig(16, 32, 1), cn.CNBlockConfig(32, None, 1)], stochastic_depth_prob=0.1,
                       num_classes=10)


def _tv_vit() -> nn.Module:
    return _tvm().VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=H, mlp_dim=2 * H,
                                    num_classes=10)


def _tv_swin() -> nn.Module:
    return _tvm().SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                  window_size=[2, 2], stochastic_depth_prob=0.1, num_classes=10)


def _regnet() -> nn.Module:
    tv = _tvm()
    params = tv.regnet.BlockParams.from_init_params(depth=2, w_0=16, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
    return tv.regnet.RegNet(params, num_classes=10)


BUILDERS: dict[str, Callable[[], Workload]] = {
    # HF decoders
    "hf-gpt2": _hf("GPT2LMHeadModel", "GPT2Config", lambda: (_ids(B, S),), _lm_loss, n_layer=2, n_embd=H, n_head=4,
                   vocab_size=V, n_positions=64),
    "hf-gpt-neox": _decoder("GPTNeoXForCausalLM", "GPTNeoXConfig"),
    "hf-gptj": _hf("GPTJForCausalLM", "GPTJConfig", lambda: (_ids(B, S),), _lm_loss, n_layer=2, n_embd=H, n_head=4,
                   rotary_dim=4, vocab_size=V, n_positions=64),
    "hf-llama": _decoder("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2),
    "hf-mistral": _decoder("MistralForCausalLM", "MistralConfig", num_key_value_heads=2),
    "hf-qwen2": _decoder("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2),
    "hf-gemma": _decoder("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=2, head_dim=8),
    "hf-gemma2": _decoder("Gemma2ForCausalLM", "Gemma2Config", num_key_value_heads=2, head_dim=8),
    "hf-phi": _decoder("PhiForCausalLM", "PhiConfig"),
    "hf-mixtral": _decoder("MixtralForCausalLM", "MixtralConfig", num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2),
    "hf-opt": _hf("OPTForCausalLM", "OPTConfig", lambda: (_ids(B, S),), _lm_loss, num_hidden_layers=2, hidden_size=H,
                  ffn_dim=2 * H, num_attention_heads=4, vocab_size=V, word_embed_proj_dim=H,
                  max_position_embeddings=64),
    "hf-bloom": _hf("BloomForCausalLM", "BloomConfig", lambda: (_ids(B, S),), _lm_loss, n_layer=2, hidden_size=H,
                    n_head=4, vocab_size=V),
    "hf-falcon": _decoder("FalconForCausalLM", "FalconConfig"),
    # HF encoder-decoders
    "hf-t5": _hf("T5ForConditionalGeneration", "T5Config", lambda: (_ids(B, S), _ids(B, S)), _seq2seq_loss,
                 num_layers=2, d_model=H, d_ff=2 * H, num_heads=4, d_kv=8, vocab_size=V, decoder_start_token_id=0,
                 pad_token_id=0),
    "hf-bart": _hf("BartForConditionalGeneration", "BartConfig", lambda: (_ids(B, S), _ids(B, S)), _seq2seq_loss,
                   encoder_layers=2, decoder_layers=2, d_model=H, encoder_ffn_dim=2 * H, decoder_ffn_dim=2 * H,
                   encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=V, max_position_embeddings=64),
    # HF encoders
    "hf-bert-sdpa": _hf("BertForMaskedLM", "BertConfig", _mlm_inputs, _mlm_loss, **_ENC),
    "hf-bert-eager": _hf("BertForMaskedLM", "BertConfig", _mlm_inputs, _mlm_loss, attn_implementation="eager", **_ENC),
    "hf-roberta": _hf("RobertaForMaskedLM", "RobertaConfig", _mlm_inputs, _mlm_loss, **_ENC),
    "hf-distilbert": _hf("DistilBertForMaskedLM", "DistilBertConfig", _mlm_inputs, _mlm_loss, n_layers=2, dim=H,
                         hidden_dim=2 * H, n_heads=4, vocab_size=V, max_position_embeddings=64),
    "hf-albert": _hf("AlbertForMaskedLM", "AlbertConfig", _mlm_inputs, _mlm_loss, embedding_size=16, **_ENC),
    "hf-electra": _hf("ElectraForMaskedLM", "ElectraConfig", _mlm_inputs, _mlm_loss, embedding_size=16, **_ENC),
    # HF vision / multimodal / audio
    "hf-vit": _hf("ViTForImageClassification", "ViTConfig", _image_inputs(), _image_loss, **_VIS),
    "hf-swin": _hf("SwinForImageClassification", "SwinConfig", _image_inputs(), _image_loss, image_size=16,
                   patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2, num_labels=4),
    "hf-beit": _hf("BeitForImageClassification", "BeitConfig", _image_inputs(), _image_loss,
                   use_relative_position_bias=True, **_VIS),
    "hf-clip": _clip,
    "hf-whisper": _whisper,
    "hf-wav2vec2": _wav2vec2,
    # torch.nn
    "torch-transformer-encoder": _encoder_lm,
    # torchvision
    "tv-resnet18": _tv(lambda: _tvm().resnet18(num_classes=10)),
    "tv-resnet50-family": _tv(_resnet_bottleneck),
    "tv-mobilenet_v3_small": _tv(lambda: _tvm().mobilenet_v3_small(num_classes=10)),
    "tv-efficientnet_b0": _tv(lambda: _tvm().efficientnet_b0(num_classes=10)),
    "tv-convnext": _tv(_convnext),
    "tv-regnet": _tv(_regnet),
    "tv-vit": _tv(_tv_vit),
    "tv-swin": _tv(_tv_swin),
    "tv-lraspp-segmentation": _segmentation,
    # timm
    "timm-vit_tiny": _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2),
    "timm-convnext_atto": _timm("convnext_atto"),
    "timm-resnet10t": _timm("resnet10t"),
    "timm-mixer": _timm_class("mlp_mixer.MlpMixer", img_size=32, patch_size=8, num_blocks=2, embed_dim=H),
    "timm-mobilenetv3": _timm("mobilenetv3_small_050"),
    "timm-efficientvit": _timm("efficientvit_b0"),
    "timm-regnety": _timm("regnety_002"),
}
NAMES = list(BUILDERS)


def build(name: str, seed: int = 0) -> Workload:
    """`(model, inputs, loss_fn)` for a sweep architecture, in training mode, weights from `seed`."""
    if name not in BUILDERS:
        raise ValueError(f"unknown sweep architecture {name!r}; known: {', '.join(NAMES)}")
    torch.manual_seed(seed)
    model, inputs, loss_fn = BUILDERS[name]()
    model.train()
    return model, inputs, loss_fn
