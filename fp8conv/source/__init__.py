"""What <ckpt> is: its shards, index, config.json and other files, local, on the Hub or streamed."""
