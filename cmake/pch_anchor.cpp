// Anchor for the shared precompiled header (see cmake/Pch.cmake).
