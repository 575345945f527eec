"""`python -m scripts.soak --minutes 15`: the soak. Its code is swarm/cli/soak*.py, installed with
the package, so that `swarm-sim --soak` runs it from a fresh install without this repository."""

from swarm.cli.soak import main

if __name__ == "__main__":
    main(prog_name="python -m scripts.soak")
