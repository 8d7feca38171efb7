"""`xlr bench`: benchmark configs, the engines they compare, and their JSON."""
