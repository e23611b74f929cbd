"""`python -m elastic._agent.launcher`: torchrun with recovery defaults (see launch.py)."""

from elastic._agent.launcher.launch import main

if __name__ == "__main__":
    main()
