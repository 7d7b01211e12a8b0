from meshpar.cli import main

main()
