"""The host side of the device: the run directory (`runstate`), attaching and detaching
(`attach`, step by step in `chain`, the nbdkit command line in `servercmd`), processes
(`procs`), `status` and health (`health`), host facts and preconditions (`facts`), `doctor`."""
