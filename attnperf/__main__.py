from attnperf.cli import main

raise SystemExit(main())
