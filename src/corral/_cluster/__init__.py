"""Corral over a Ray cluster (issue 17, first part): a Corral node per Ray node that offers the
``corral`` resource, and a gateway that places each sandbox on a node and routes its calls
there. See ``gateway`` for what is built and what is not yet."""
