from attnctl.cli import main

main()
