"""The ``score`` job (:func:`score_pool`, what ``prism-select score`` runs), in parts:

``inputs``              the pool and target pairs read and tokenised (:class:`Inputs`)
``folder``              the run folder's life cycle: lock, ``.partial``, resume, reuse
``preflight``           checks before the model loads, the small-pool rule, the memory plan
``curvature_provider``  the run's curvature: fit / cache / spill / transient groups
``split_half``          the split-half damping check
``scorer``              the pool scored along preconditioned directions, by its route
``meter``               stage timings and memory peaks
``result``              ``run.json`` as a typed :class:`Run`
``context``             :class:`RunContext`, what every scoring method gets
``job``                 :func:`score_pool`: inputs -> method -> files
"""

from .context import RunContext
from .inputs import Inputs, prepare_inputs
from .job import score_pool, score_rows
from .result import Run

__all__ = ["Inputs", "Run", "RunContext", "prepare_inputs", "score_pool", "score_rows"]
