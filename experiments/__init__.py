"""Runnable jobs: `python -m experiments.<name> --help`."""
