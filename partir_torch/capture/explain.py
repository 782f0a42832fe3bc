"""Capture errors said plainly: where in the user's code, which module, which shapes, and what would help."""

from __future__ import annotations

import traceback

import torch
import torch.nn as nn

from partir_torch import _compat
from partir_torch.capture.attribution import ModuleTracker
from partir_torch.capture.convert import OUR_DIR, TORCH_DIR
from partir_torch.errors import CaptureError, InputShapeError


def data_dependent(e: Exception) -> bool:
    """A value read (`.item()`, a branch on a tensor) or an op whose output shape depends on values (`nonzero`)."""
    text = str(e)
    return (isinstance(e, _compat.DataDependentOutputException | _compat.DynamicOutputShapeException)
            or "data-dependent" in text or "data dependent" in text)


def user_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost of `frames` in the user's code (outside torch and this package)."""
    for f in reversed(frames):
        if not f.filename.startswith(TORCH_DIR) and not f.filename.startswith(OUR_DIR):
            return f
    return None


def _user_frame(e: BaseException) -> traceback.FrameSummary | None:
    return user_frame(traceback.extract_tb(e.__traceback__))


class CompiledPathError(CaptureError):
    """Data-dependent control flow: `capture` tries the library's compiled path (libraries skip such checks
    when compiled: HF's padding and SDPA mask checks), and raises this when that fails too."""


def explain(e: Exception, tracker: ModuleTracker, inputs: tuple[torch.Tensor, ...]) -> CaptureError:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    frame = _user_frame(e)
    where = f" at {frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)" if frame else ""
    text = str(e)
    if data_dependent(e):
        return CompiledPathError(
            f"the model has data-dependent Python control flow or reads a tensor's value{where}: capture traces "
            "with shapes only, so a branch or `.item()` on tensor values cannot be followed. Replace it with "
            f"torch.where / masking, or make it depend on shapes only.{_compile_hint(frame)}{_opaque_hint(tracker)} "
            f"(torch said: {msg})"
        )
    if isinstance(e, _compat.UnsupportedOperatorException):
        return CaptureError(
            f"operator {e.func} has no shape (meta/fake) implementation, so it cannot be captured{where}. Use a "
            "standard op instead, or register a fake implementation with torch.library.register_fake."
        )
    given = ", ".join(f"inputs[{i}]: {list(x.shape)} {str(x.dtype).removeprefix('torch.')}"
                      for i, x in enumerate(inputs))
    in_module = ""
    if tracker.failed_in is not None:
        path, mod, shapes = tracker.failed_in
        own = ", ".join(f"{n} {list(p.shape)}" for n, p in mod.named_parameters(recurse=False))
        in_module = f" in module {path or '<root>'!r} ({type(mod).__name__}{'; ' + own if own else ''})"
    if tracker.failed_in is not None and any(w in text.lower() for w in _SHAPE_WORDS):
        expect = _expected(mod)
        return InputShapeError(
            f"capture failed in module {path or '<root>'!r} ({type(mod).__name__}{'; ' + own if own else ''}){where}: "
            f"{msg}. It received input shapes {shapes}{'; it expects ' + expect if expect else ''}. "
            f"Example inputs given: {given}. Check that the example inputs have the shapes the model expects."
        )
    patched = ""
    if tracker.failed_in is not None and type(mod).__module__.startswith("torch_xla"):
        orig = f"torch.nn.{type(mod).__name__}._orig"
        patched = (f" {type(mod).__name__} here is torch_xla's replacement ({type(mod).__module__}): importing "
                   "torch_xla "
                   f"patches torch.nn.{type(mod).__name__} with it, and it cannot be traced; build the module with "
                   f"{orig} (the original torch class), or build the model before torch_xla is imported.")
    return CaptureError(f"capture failed{in_module}{where}: {msg}.{patched}{_training_hint(frame)} "
                        f"Example inputs given: {given}.")


def _opaque_hint(tracker: ModuleTracker) -> str:
    """Inside a submodule, fallback=True captures that module as one replicated op."""
    if tracker.failed_in is None or not tracker.failed_in[0]:
        return ""
    path, mod, _ = tracker.failed_in
    return (f" Or capture with fallback=True (CLI --fallback): module {path!r} ({type(mod).__name__}) then "
            f"becomes one opaque op that runs replicated ({OPAQUE_HINT}).")


OPAQUE_HINT = "no sharding inside it; its FLOPs measured by running it once"
EVAL_HINT = "capture the model in eval mode (model.eval(): no dropout)"


def _near(frame: traceback.FrameSummary | None) -> str:
    """The failing line of user code and the 3 lines before it."""
    if frame is None:
        return ""
    try:
        with open(frame.filename) as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[max(0, (frame.lineno or 1) - 4): frame.lineno or 1])


def _training_hint(frame: traceback.FrameSummary | None) -> str:
    """A construct that only runs in training mode (a training-only check on values, a training-only
    autograd.Function) is avoided by the library's own eval path."""
    if "self.training" not in _near(frame):
        return ""
    return f" The failing code runs only in training mode: {EVAL_HINT}, or turn the library's option off."


def _compile_hint(frame: traceback.FrameSummary | None) -> str:
    """When the failing check is skipped under torch.compile, say how to take that branch."""
    near = _near(frame)
    if not any(w in near for w in ("is_tracing", "is_compiling", "is_torchdynamo_compiling")):
        return _training_hint(frame)
    hf = (" For HF transformers models, attn_implementation=\"eager\" in the config also avoids the SDPA mask "
          "check." if "transformers" in frame.filename else "")
    return (" This library skips the check when it is compiled: assume_compiling=True (of capture, search, "
            f"auto_shard and AutoShardStrategy; CLI --assume-compiling) takes that path.{hf}")


_SHAPE_WORDS = ("shape", "size", "dimension", "mat1 and mat2", "expected input", "must match", "broadcast")


def _expected(mod: nn.Module) -> str:
    if isinstance(mod, nn.Linear):
        return f"[..., {mod.in_features}]"
    if isinstance(mod, nn.Conv2d | nn.Conv1d | nn.Conv3d):
        return f"[N, {mod.in_channels}, ...]"
    if isinstance(mod, nn.Embedding):
        return f"integer indices < {mod.num_embeddings}"
    if isinstance(mod, nn.LayerNorm):
        return f"[..., {', '.join(map(str, mod.normalized_shape))}]"
    return ""
