"""The fault matrix: which faults keras-dp is tested against, and docs/reliability.md made from the results.

``matrix.py`` holds the rows; ``report.py`` writes the page from the tests' junit XML (``nox -s
reliability`` runs both); ``test_matrix.py`` checks that the rows name real tests and that the page
lists them.
"""
