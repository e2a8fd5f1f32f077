"""One env's life, from ledger intent to confirmed absence, shared by every kind of episode.

``lease`` (``EnvLease``: the only writer of env rows: intent, created/ready, windowed destroy,
proof), ``episode`` (``Episode``: provision, run, collect, verify, export, destroy), ``run``
(a batch episode's RUN and the outcome of its answer), ``clock`` (phase timings), ``shield``
(cleanup that outlives cancellation), ``context`` (what a run gives its episodes).
"""
