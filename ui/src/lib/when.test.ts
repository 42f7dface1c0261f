import { describe, expect, it } from 'vitest';
import { when } from './library';

describe('when', () => {
  const now = new Date(2026, 10, 29, 15, 0);
  it('says the time for today, the day for another day, the year for another year', () => {
    expect(when(new Date(2026, 10, 29, 9, 5).toISOString(), now)).toBe('09:05');
    expect(when(new Date(2026, 4, 3, 9, 5).toISOString(), now)).toBe('3 May');
    expect(when(new Date(2025, 4, 3, 9, 5).toISOString(), now)).toBe('3 May 2025');
  });
  it('says nothing for what is not a time', () => {
    expect(when('not a time', now)).toBe('');
  });
});
