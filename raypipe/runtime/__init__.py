"""What every actor needs to know about where it runs: the Ray connection, its device and dtype, its threads."""
