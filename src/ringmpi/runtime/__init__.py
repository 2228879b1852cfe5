"""The process around the math: error types and their agreement, the watchdog over blocking phases,
fault injection for tests, environment settings, the GPU binding.  Depends on nothing else of ringmpi."""
