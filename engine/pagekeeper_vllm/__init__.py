"""pagekeeper for upstream vLLM: the allocator exporter plugin, the launcher and their bundle.

vLLM runs in its own image; nothing here may need more than the Python standard library and,
in the processes that drive a GPU, the torch that vLLM already loaded. `bundle` copies this
package and the few pure engine modules it reuses into a directory an init container shares
with the vLLM container (`PYTHONPATH`), with the dist-info that makes vLLM find the plugin.
"""
