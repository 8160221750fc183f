"""The restorer: chain resolution, disk-block reads, output targets."""
