"""What a checkpoint's names, dtypes and config mean: formats, families, MLP roles, ignore lists."""
