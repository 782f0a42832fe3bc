"""`python -m partir_torch.cli`."""

from partir_torch.cli import main

raise SystemExit(main())
