"""Check scripts torchrun runs as files (see launcher.py), and the launcher the tests call."""
