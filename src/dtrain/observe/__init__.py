"""Seeing a run: its trace and metrics while it runs, its report afterwards.

* :mod:`.trace` -- timeline events and per-step metrics rows;
* :mod:`.step_stats` -- what one step of a data-parallel engine cost (compute, communication, waits);
* :mod:`.attribution` -- which rank the others waited for, and what bounds a step;
* :mod:`.report` -- ``dtrain report``: the text summary;
* :mod:`.report_data` and :mod:`.report_html` -- the figures of ``report.html`` and the page;
* :mod:`.charts` -- inline SVG charts for the page.

This package imports nothing itself.
"""
