"""The E2B dialect: the official E2B SDKs' control-plane REST API, envd's HTTP and Connect
services and the code interpreter's ``/execute``, served over the same control plane as Corral's
own API (see ``app.py``)."""
