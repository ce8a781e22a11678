"""The Keras parity matrix: does ``Trainer(num_replicas=2).fit(model, ...)`` give what
``model.fit`` gives on one device?

``scenarios.py`` declares each scenario; ``runners.py`` holds the two sides (plain Keras, a
backend's Trainer); ``run.py`` runs every scenario on one backend in a fresh process;
``test_parity.py`` compares; ``compatibility.py`` writes docs/keras-compatibility.md.
"""
