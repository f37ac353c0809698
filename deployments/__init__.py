"""Ray Serve: LLM server deployment, OpenAI ingress, adapter registry and hot-load, app builder, CLI.

Import the submodules directly (`deployments.app`, `deployments.cli`); this
package file imports nothing, so `deployments.demo_model` stays importable
without Ray Serve.
"""
