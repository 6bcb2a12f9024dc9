"""``python -m vqserve`` runs the same CLI as the ``vqserve`` console script."""

from vqserve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
