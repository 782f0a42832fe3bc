"""`python -m partir_torch.cli`."""

from partir_torch.cli import main

if __name__ == "__main__":  # (not in the ranks `partir-torch bench` spawns, which import this module again)
    raise SystemExit(main())
