"""The command line: commands, -j workers, the entry point; the only place that prints or exits."""
