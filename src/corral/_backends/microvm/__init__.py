"""The microVM tier (issue 14), not yet selectable: guest kernel, QEMU launch, guest agent."""
