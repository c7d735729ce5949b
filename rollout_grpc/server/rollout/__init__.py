"""The use cases on top of the domain: one sample's generation, admission, in-flight registry, render,
fleet control.
"""
