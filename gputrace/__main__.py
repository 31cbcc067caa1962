from gputrace.cli import main

raise SystemExit(main())
