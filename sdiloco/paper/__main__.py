"""`python -m sdiloco.paper`: regenerate the paper's artifacts (see `figures.main`)."""

from .figures import main


if __name__ == "__main__":
    raise SystemExit(main())
