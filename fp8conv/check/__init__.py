"""Reading a checkpoint or an output back: inspect and verify."""
