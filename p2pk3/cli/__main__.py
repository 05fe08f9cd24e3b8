import sys

from p2pk3.cli import main

sys.exit(main(prog_name="p2pk3"))
