"""What a run trains: models, datasets and how a batch splits over the workers.

* :mod:`.models` -- the CNN and MLP classifiers and the GPT family;
* :mod:`.data` -- the bundled datasets (scikit-learn's digits, a synthetic teacher task, text);
* :mod:`.files` -- the user's own data (``--dataset PATH``): text, token files, images, arrays, tables;
* :mod:`.batch` -- how a global batch splits over data-parallel shards;
* :mod:`.load` -- a model and one batch for it, by name (what the planner and calibration profile).

The models are also ``dtrain.models``. Text from a trained language model (``dtrain sample``)
is :mod:`dtrain.observe.sample`.

This package imports nothing itself.
"""
