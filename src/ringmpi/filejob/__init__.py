"""The file job of ``ringmpi run``: parallel HDF5 in and out, the plan of passes, resume, the output's
attributes and per-head datasets.  :func:`run_job`, :class:`JobOptions`, :class:`JobResult` and
:class:`OutputAttributes` are its public names (docs/file-format.md)."""

from .job import JobOptions, JobResult, OutputAttributes, run_job

__all__ = ["JobOptions", "JobResult", "OutputAttributes", "run_job"]
