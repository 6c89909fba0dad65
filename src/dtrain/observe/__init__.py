"""Seeing a run: its trace and metrics while it runs, its report afterwards.

* :mod:`.attribution` -- which rank the others waited for, and what bounds a step;
* :mod:`.report` -- ``dtrain report``: the text summary;
* :mod:`.report_data` and :mod:`.report_html` -- the figures of ``report.html`` and the page;
* :mod:`.report_sweep` -- ``report.html`` of a sweep folder;
* :mod:`.charts` -- inline SVG charts for the page;
* :mod:`.sample` -- ``dtrain sample``: text from a trained language model.

The timeline events and metrics rows a run writes are :mod:`dtrain.trace`'s; what one step of
an engine cost (compute, communication, waits) is :mod:`dtrain.comm.step_stats`.

This package imports nothing itself.
"""
