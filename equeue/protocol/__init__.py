"""The equeue wire protocol: frames, the handshake, records and errors on the wire.

Used by the broker (equeue/server/) and the clients (equeue/client/), nothing else;
docs/protocol.md describes it for a client in any language.
"""
