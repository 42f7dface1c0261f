import { defineConfig } from 'vite';
import { svelte } from '@sveltejs/vite-plugin-svelte';

// Tauri 2 embeds the output of `npm run build` (frontendDist: ../ui/dist)
// and points its dev webview at http://localhost:1420 (devUrl) for `npm run dev`.
export default defineConfig({
  plugins: [svelte()],
  // Relative asset URLs: harmless under Tauri, and lets dist/ be served from any path.
  base: './',
  // Keep Rust compiler output visible when run by `cargo tauri dev`.
  clearScreen: false,
  server: {
    port: 1420,
    strictPort: true,
    watch: {
      // The Rust side lives next door; don't watch it.
      ignored: ['**/src-tauri/**', '**/target/**'],
    },
  },
  envPrefix: ['VITE_', 'TAURI_ENV_'],
  build: {
    // webkit2gtk 2.36+ (Linux) and WKWebView on macOS 12+ handle Safari 15 output.
    target: 'safari15',
    outDir: 'dist',
    emptyOutDir: true,
    sourcemap: false,
  },
});
