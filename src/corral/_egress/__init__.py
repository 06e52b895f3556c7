"""The egress gateway: policy matching, address vetting, the proxy, brokered secrets."""
