"""The one serving path both protocols share: the ``engine`` (check input, batch, run, record),
its dynamic ``batcher``, the ``model_threads`` that run model calls, and the execution plan a
server serves by (``serving_plan``) and measures beside itself (``planning``)."""
