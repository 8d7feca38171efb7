"""The always-on engine: the scheduler loop, requests and their state, the step's inputs."""
