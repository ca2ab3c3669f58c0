"""Measurement backends, the parent side of the process boundary: the interface and the ``simulate``
backend (``base``), the one name -> class map (``factory``), the ``profile`` backend that launches a
real engine per trial (``profiled``) through the launcher (``launch``, with ``logs`` reading what a
dead rank left behind), and the ``replay`` backend answering from measured CSV rows (``replay``).
Nothing here imports torch; the launched processes run :mod:`autotune.worker`."""
