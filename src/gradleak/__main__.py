"""``python -m gradleak``: the command line (:mod:`gradleak.cli`), where no console script is installed."""

from gradleak.cli import main

raise SystemExit(main())
