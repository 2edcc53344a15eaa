from zerotrain.cli import main

raise SystemExit(main())
