"""The Service layer: the listeners, their drain, and the admin endpoints.

``serve`` and the accept loops, the admin API with its dashboard page
(``dashboard.html``), the reload, the history, the worker processes. It
may import ``proxy/`` and the layers below it.
"""
