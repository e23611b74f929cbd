"""`python -m elastic.launcher`: torchrun with recovery defaults (see launch.py)."""

from elastic.launcher.launch import main

if __name__ == "__main__":
    main()
