from tvmflash.cli import main

main()
