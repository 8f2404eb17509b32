from kevscore.cli import main

main()
