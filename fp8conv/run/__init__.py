"""A conversion from its first step to its last: prepare, dry run, the scheduler, --stream."""
