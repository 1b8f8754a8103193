from tandemrl.cli.main import main

raise SystemExit(main())
