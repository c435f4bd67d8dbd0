"""The ``mtk`` command line: a thin dispatcher (main.py) and one module per subcommand."""
