from celerytp.cli import main

raise SystemExit(main())
