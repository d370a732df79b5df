"""Launching: how a process learns its place in the job (torchrun / MPI / Slurm variables)
and the ``scaleout run`` launcher that starts and owns the ranks."""
