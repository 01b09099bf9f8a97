"""The JuicyTalk driver: sweep file -> Ray Tune -> Parquet store -> report -> CLI."""
